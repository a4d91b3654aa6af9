"""The SGLang backend's response parsing (the backend itself needs a CUDA GPU: untested here)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.sampler import GenerateRequest, parse_sglang_response


def _body(logprob_rows):
    # The shape SGLang documents for return_sampling_mask: one kept-id list and one
    # renormalised log-prob list per generated token.
    return {
        "output_ids": [7, 3],
        "meta_info": {
            "output_token_sampling_mask": [[7, 2], [3]],
            "output_token_sampling_logprobs": logprob_rows,
            "finish_reason": {"type": "stop", "matched": 3},
            "prompt_tokens": 4,
            "weight_version": "5",
        },
    }


def test_parse_sampling_mask_into_csr() -> None:
    req = GenerateRequest(request_id="r", prompt_ids=[1, 2, 3, 4], max_new_tokens=8, stop_token_ids=[3])
    res = parse_sglang_response(req, _body([[math.log(0.75), math.log(0.25)], [0.0]]), pool="h100", seconds=0.1)
    assert res.token_ids == [7, 3] and res.finish_reason == "stop" and res.versions == [5, 5]
    assert res.support_ids.tolist() == [7, 2, 3] and res.support_offsets.tolist() == [0, 2, 3]
    torch.testing.assert_close(res.support_logq.exp(), torch.tensor([0.75, 0.25, 1.0]))
    res.support().token_index(torch.tensor(res.token_ids))


def test_parse_refuses_rows_without_per_id_logq() -> None:
    req = GenerateRequest(request_id="r", prompt_ids=[1], max_new_tokens=8)
    with pytest.raises(ValueError, match="token 0: SGLang gave no log q for each kept id"):
        parse_sglang_response(req, _body([-0.3, 0.0]), pool="h100", seconds=0.1)
    body = _body([[0.0, -1.0], [0.0]])
    body["meta_info"]["output_token_sampling_mask"] = [[1, 2], [3]]
    with pytest.raises(ValueError, match="token 0: sampled id 7 is not in its sampling mask"):
        parse_sglang_response(req, body, pool="h100", seconds=0.1)
