"""A harness that talks to the model once and then crashes."""

import sys

from openai import OpenAI

client = OpenAI(max_retries=0)
client.chat.completions.create(model="flotilla", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
print("about to fail", file=sys.stderr)
raise SystemExit("the agent fell over")
