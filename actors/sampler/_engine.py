"""A lean dense decoder with a slot-based KV cache (the torch generation backend's core).

Written with plain torch ops from the HF model's weights and exact to
``transformers``' forward of the families in ``actors.models.SUPPORTED_MODEL_TYPES``:
Qwen3 (per-head q/k RMSNorm), Qwen2/2.5 (q/k/v bias), Llama 3 (``llama3`` rope
scaling; optional attention/MLP bias) and Mistral.  All share RMSNorm in float32,
RoPE (default, ``linear`` or ``llama3`` frequencies, computed by transformers' own
rope functions), GQA attention, SwiGLU MLP, final norm, untied or tied lm_head;
tests pin each family's logits to transformers' within 1e-4 in float32, prefill
and decode.  Sliding-window attention is accepted only where the window covers
the whole context (then it changes nothing); anything else is refused by name.

KV cache: per layer one key and one value tensor ``[slots, kv_heads, max_len,
head_dim]`` plus a length per slot.  A slot belongs to one sequence from its
prefill until it is freed.  ``prefill`` writes whole prompts into chosen slots
(right-padded batch, so positions are 0..len-1 in every row); ``decode`` appends
one token to each of a set of slots in one batched step, each row attending to
its own prefix through a per-slot mask.  Which slots run together can change
between any two calls -- that is what continuous batching needs.

Weights (the checkpoint-to-compute mapping lives in ``_weights``): the engine reads
a *wire snapshot* (``name -> tensor`` as the weight sync delivers it: bf16 tensors,
or float8_e4m3fn tensors with a float32 ``<name>_scale_inv`` of 128x128 block
scales) and keeps a compute copy in ``compute_dtype``. On CPU that is float32: the
values are exactly the pool's bf16/fp8 values, upcast once per weight update instead
of per matmul, because CPU bf16 matmuls are slower than float32 ones at these sizes.
On CUDA the default is bf16. FP8 weights of the linear layers stay FP8 and multiply
through ``torch._scaled_mm`` (``_fp8mm``) on GPUs with FP8 tensor cores (capability
>= 8.9), and are dequantised elsewhere; the CUDA paths have never run here (no GPU).

Nothing here is thread-safe or async: the caller (the batcher, driven by one
trio task) calls ``load``/``prefill``/``decode`` strictly one after another, so
a weight update always lands between two decode steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from actors.models import load_model_config

from ._emulate import EMULATED_FORMATS, emulate_quant
from ._fp8mm import Fp8Weight, fp8_matmul_available, linear
from ._weights import LINEAR_BLOCKS, layer_parts, patch_in_place, rope_frequencies, wire_to_compute

__all__ = ["DecoderEngine", "Qwen3Engine", "first_outside_vocab"]


def _linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None) -> torch.Tensor:
    """``linear`` (dense or FP8 weight) with an optional bias; dense with a bias is one
    ``F.linear``, as in the HF module, so float32 results match it."""
    if b is None:
        return linear(x, w)
    if isinstance(w, Fp8Weight):
        return linear(x, w) + b
    return F.linear(x, w, b)


def first_outside_vocab(ids: Sequence[int], vocab: int) -> int | None:
    """The position of the first id outside ``[0, vocab)``, or None (the usual case,
    settled by ``min``/``max`` at C speed before any per-id loop)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return None
    return next(i for i, tok in enumerate(ids) if not 0 <= tok < vocab)


def _cache_rows(slots: list[int], slot_idx: torch.Tensor) -> slice | torch.Tensor:
    """How to read ``slots``' rows of a KV cache: a slice (a view, no copy) when they are a
    contiguous run in order, else their index tensor (rows gathered)."""
    first = slots[0]
    return slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else slot_idx


def _read_cache(cache: torch.Tensor, rows: slice | torch.Tensor, span: int) -> torch.Tensor:
    """``cache[rows, :, :span]`` for ``rows`` from ``_cache_rows``."""
    if isinstance(rows, slice):
        return cache[rows, :, :span]
    return cache[:, :, :span].index_select(0, rows)


class DecoderEngine:
    """Batched decoder forward over a slot KV cache.  See the module docstring.

    Args:
        config: model config dict (``actors.models``) or checkpoint directory; a
            ``model_type`` outside the supported families raises ValueError naming them.
        max_slots: KV-cache slots, i.e. the most sequences decoding at once.
        max_len: tokens per slot (prompt + generated); defaults to the config's
            ``max_position_embeddings``.
        device: "cpu" or "cuda[:i]".
        compute_dtype: dtype of activations and compute weights (default float32
            on CPU, bfloat16 on CUDA).
        fp8_matmul: keep FP8 linear weights in FP8 and multiply with ``torch._scaled_mm``;
            None: where the device has FP8 tensor cores (``fp8_matmul_available``).
        emulate: a coarse format (``actors.sampler._emulate``) every linear weight is
            rounded through before use, or None; it turns ``fp8_matmul`` off.
    """

    def __init__(
        self,
        config: dict[str, Any] | str,
        *,
        max_slots: int,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        fp8_matmul: bool | None = None,
        emulate: str | None = None,
    ) -> None:
        cfg = load_model_config(config)
        inv_freq, rope_scale = rope_frequencies(cfg)
        if cfg.hidden_act != "silu":
            raise ValueError(f"model config: hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if emulate is not None and emulate not in EMULATED_FORMATS:
            raise ValueError(f"emulate_quant must be one of {EMULATED_FORMATS} or None, got {emulate!r}")
        self.emulate = emulate
        self.device = torch.device(device)
        # FP8 weights stay FP8 for the linear layers where the GPU multiplies FP8 (else dequantised)
        self.fp8_matmul = fp8_matmul_available(self.device) if fp8_matmul is None else fp8_matmul
        self.fp8_matmul = self.fp8_matmul and emulate is None  # an emulated format multiplies dense
        self.dtype = compute_dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.vocab_size = cfg.vocab_size
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.tied = bool(cfg.tie_word_embeddings)
        self.max_slots = max_slots
        self.max_len = max_len or cfg.max_position_embeddings
        window = getattr(cfg, "sliding_window", None)
        if window is not None and window < self.max_len:
            raise ValueError(
                f"model config: sliding_window={window} is shorter than the context "
                f"({self.max_len} tokens); sliding-window attention is not supported"
            )
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        self.qk_norm = cfg.model_type == "qwen3"
        self._parts = layer_parts(
            qk_norm=self.qk_norm,
            qkv_bias=cfg.model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and cfg.model_type != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        )
        self._q_dim = self.n_heads * self.head_dim
        self._kv_dim = self.n_kv * self.head_dim

        # RoPE table computed as HF does (float32 positions x inv_freq), indexed by position.
        freqs = torch.arange(self.max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * rope_scale).to(self.device, self.dtype)
        # rotate_half(x) * sin == roll(x, d/2) * sin_signed, where sin_signed negates the
        # first half: (-a) * s == a * (-s) exactly, so this is HF's RoPE bit for bit with one
        # roll instead of two slices, a negation and a cat.
        sin = emb.sin() * rope_scale
        sin[:, : sin.shape[1] // 2].neg_()
        self._sin = sin.to(self.device, self.dtype)

        shape = (max_slots, self.n_kv, self.max_len, self.head_dim)
        self._k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        self._v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        self.lengths = torch.zeros(max_slots, dtype=torch.long)
        """Tokens held per slot (host tensor; the engine's caller owns slot bookkeeping)."""
        self._layers: list[dict[str, torch.Tensor]] = [{} for _ in range(self.n_layers)]
        self._top: dict[str, torch.Tensor] = {}
        self._loaded = False

    # ------------------------------------------------------------------ weights
    def weight_names(self) -> list[str]:
        """HF parameter names the engine reads from a snapshot."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tied:
            names.append("lm_head.weight")
        for i in range(self.n_layers):
            names += [f"model.layers.{i}.{p}" for parts in self._parts.values() for p in parts]
        return names

    @torch.no_grad()
    def load(self, snapshot: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> None:
        """(Re)build compute weights from a wire snapshot.

        ``names``: the snapshot entries that changed (``<name>_scale_inv`` counts
        as its weight); None rebuilds everything.  Only the touched fused blocks
        are rebuilt, so a sparse delta costs little.  A mapping ``name -> element
        indices`` (``WeightReceiver.last_changed`` narrowed to those names; None for
        a whole tensor) says more: the snapshot differs from the weights loaded last
        only at those flat elements, and they are written into the existing compute
        tensors in place (``patch_in_place``), so an update costs what changed, not
        the model.  The whole-tensor path stays for FP8 wire tensors (with
        ``_scale_inv``), FP8 matmul blocks and the linear blocks of an ``emulate``
        format (it rounds whole weights); the derived ``qk_norm`` block is rebuilt
        from ``q_norm``/``k_norm`` either way.

        Raises KeyError/ValueError naming a missing or malformed tensor; the
        previous weights then stay in use only for the blocks not yet rebuilt, so
        the caller must treat a failed load as fatal for the snapshot (reload it whole).
        """
        expected = {name: None for name in self.weight_names()}
        if names is None or not self._loaded:
            touched = set(expected)
        else:
            touched = {n.removesuffix("_scale_inv") for n in names} & expected.keys()
        if not self._loaded:
            missing = [n for n in expected if n not in snapshot]
            if missing:
                raise KeyError(f"weight snapshot lacks {len(missing)} tensors, first {missing[0]!r}")
        elements = names if isinstance(names, Mapping) and self._loaded else None

        def get(name: str) -> torch.Tensor:
            return wire_to_compute(snapshot, name, self.dtype, self.device)

        def patched(current: Any, full: list[str]) -> bool:
            if elements is None or not isinstance(current, torch.Tensor):
                return False
            return patch_in_place(current, snapshot, full, {n: elements[n] for n in full if n in elements})

        lm = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        for name, key in (("model.embed_tokens.weight", "embed"), ("model.norm.weight", "norm"), (lm, "lm_head")):
            if name in touched and not patched(self._top.get(key), [name]):
                self._top[key] = get(name)
        for i, layer in enumerate(self._layers):
            prefix = f"model.layers.{i}."
            for key, parts in self._parts.items():
                full = [prefix + p for p in parts]
                if not any(n in touched for n in full):
                    continue
                emulated = self.emulate is not None and key in LINEAR_BLOCKS
                if not emulated and patched(layer.get(key), full):
                    pass
                elif self.fp8_matmul and key in LINEAR_BLOCKS and snapshot[full[0]].dtype == torch.float8_e4m3fn:
                    layer[key] = Fp8Weight.cat(
                        [Fp8Weight.from_wire(snapshot[n], snapshot[n + "_scale_inv"], self.device) for n in full]
                    )
                else:
                    tensors = [get(n) for n in full]
                    if emulated:
                        tensors = [emulate_quant(t, self.emulate) for t in tensors]  # type: ignore[arg-type]
                    layer[key] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0).contiguous()
                if key in ("q_norm", "k_norm") and "q_norm" in layer and "k_norm" in layer:
                    layer["qk_norm"] = torch.cat(
                        (layer["q_norm"].expand(self.n_heads, -1), layer["k_norm"].expand(self.n_kv, -1))
                    )
        self._check_shapes()
        self._loaded = True

    def _check_shapes(self) -> None:
        h = self._top["embed"].shape[1]
        qkv = self._q_dim + 2 * self._kv_dim
        want = {
            "qkv": (qkv, h),
            "o": (h, self._q_dim),
            "q_norm": (self.head_dim,),
            "k_norm": (self.head_dim,),
            "ln1": (h,),
            "ln2": (h,),
            "qkv_b": (qkv,),
            "o_b": (h,),
        }
        for i, layer in enumerate(self._layers):
            for key, shape in want.items():
                if key not in self._parts:
                    continue
                if tuple(layer[key].shape) != shape:
                    raise ValueError(f"layer {i} weight {key} has shape {tuple(layer[key].shape)}, expected {shape}")
        if self._top["embed"].shape[0] != self.vocab_size or self._top["lm_head"].shape != self._top["embed"].shape:
            raise ValueError(
                f"embed/lm_head shapes {tuple(self._top['embed'].shape)}/{tuple(self._top['lm_head'].shape)} "
                f"do not match vocab_size {self.vocab_size}"
            )

    # ------------------------------------------------------------------ forward
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # Same math as HF's RMSNorm in float32, in one fused kernel; a [heads, d]
            # weight (q_norm and k_norm stacked) is applied after it.
            if w.dim() == 1:
                return F.rms_norm(x, (x.shape[-1],), w, self.eps)
            return F.rms_norm(x, (x.shape[-1],), None, self.eps) * w
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # ``sin`` rows are ``self._sin``'s: sign-folded (see __init__).
        return x * cos + x.roll(self.head_dim // 2, -1) * sin

    def _qkv(self, layer: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, H] -> q [B, heads, T, d], k/v [B, kv_heads, T, d] (normed, rotated)."""
        b, t, _ = h.shape
        # q and k heads are normed and rotated together (one op each instead of two).
        qkv = _linear(h, layer["qkv"], layer.get("qkv_b"))
        qkv = qkv.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        n_qk = self.n_heads + self.n_kv
        qk = qkv[:, :, :n_qk]
        if self.qk_norm:
            qk = self._rms(qk, layer["qk_norm"])
        qk = qk.transpose(1, 2)
        q, k = self._rope(qk, cos, sin).split((self.n_heads, self.n_kv), dim=1)
        return q, k, qkv[:, :, n_qk:].transpose(1, 2)

    def _mlp_block(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self._rms(x, layer["ln2"]), layer["gate_up"], layer.get("gate_up_b")).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, layer["down"], layer.get("down_b"))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(x, self._top["norm"]), self._top["lm_head"]).float()

    def _check_ready(self, slots: Sequence[int]) -> None:
        if not self._loaded:
            raise RuntimeError("engine has no weights: call load() first")
        for s in slots:
            if not 0 <= s < self.max_slots:
                raise ValueError(f"slot {s} outside [0, {self.max_slots})")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots repeat: {list(slots)}")

    @torch.no_grad()
    def prefill(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], *, all_logits: bool = False
    ) -> torch.Tensor:
        """Write prompts into ``slots`` (resetting them) and return float32 logits.

        Returns [B, V] logits at each prompt's last position, or [B, T, V] for
        every position with ``all_logits`` (rows past a prompt's end are padding).
        Raises ValueError for an empty prompt, a prompt longer than ``max_len``
        or a token id outside the vocabulary (naming the row and position).
        """
        self._check_ready(slots)
        if len(slots) != len(prompts) or not prompts:
            raise ValueError(f"prefill needs one prompt per slot, got {len(prompts)} prompts for {len(slots)} slots")
        lens = [len(p) for p in prompts]
        for row, p in enumerate(prompts):
            if not 0 < len(p) <= self.max_len:
                raise ValueError(f"prompt {row} has {len(p)} tokens; must be 1..{self.max_len}")
            if (i := first_outside_vocab(p, self.vocab_size)) is not None:
                raise ValueError(f"prompt {row} position {i}: token id {p[i]} outside vocab [0, {self.vocab_size})")
        t = max(lens)
        ids = torch.zeros(len(prompts), t, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        slot_idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
        cos, sin = self._cos[:t], self._sin[:t]
        x = F.embedding(ids, self._top["embed"])
        for li, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
            # Right padding: pad rows sit after every real position, so the plain causal
            # mask is exact for real rows; pad K/V land past the slot's length and are
            # overwritten by later decode steps before anything can attend to them.
            self._k[li][slot_idx, :, :t] = k
            self._v[li][slot_idx, :, :t] = v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + _linear(a.transpose(1, 2).reshape(len(slots), t, self._q_dim), layer["o"], layer.get("o_b"))
            x = self._mlp_block(layer, x)
        self.lengths[list(slots)] = torch.as_tensor(lens, dtype=torch.long)
        if all_logits:
            return self._logits(x)
        last = torch.as_tensor([n - 1 for n in lens], device=self.device)
        return self._logits(x[torch.arange(len(slots), device=self.device), last])

    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens[i]`` to slot ``slots[i]`` for all i in one step; float32 logits [B, V].

        Raises ValueError when a slot is full (its length reached ``max_len``) or a
        token id is outside the vocabulary.
        """
        self._check_ready(slots)
        b = len(slots)
        if b != len(tokens) or b == 0:
            raise ValueError(f"decode needs one token per slot, got {len(tokens)} tokens for {b} slots")
        slots, tokens = list(slots), list(tokens)
        # Host bookkeeping in Python ints: a step is a handful of tiny tensors, so every
        # avoided op counts.
        pos_host = self.lengths[slots].tolist()
        top = max(pos_host)
        if top >= self.max_len:
            raise ValueError(f"a slot is full ({self.max_len} tokens); free it before decoding more")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"decode token ids {tokens} include one outside vocab [0, {self.vocab_size})")
        span = top + 1
        dev = self.device
        pos = torch.tensor(pos_host, dtype=torch.long, device=dev)
        slot_idx = torch.tensor(slots, dtype=torch.long, device=dev)
        rows = _cache_rows(slots, slot_idx)
        # Rows at one position (sequences in step) all attend to the whole span: no mask.
        # Otherwise an additive float mask (cheaper than a boolean one in CPU SDPA), shared
        # by all layers.
        mask = None
        if min(pos_host) != top:
            mask = torch.zeros(b, 1, 1, span, device=dev, dtype=self.dtype).masked_fill_(
                (torch.arange(span, device=dev)[None, :] > pos[:, None])[:, None, None, :], float("-inf")
            )
        cos = self._cos.index_select(0, pos)[:, None, None, :]
        sin = self._sin.index_select(0, pos)[:, None, None, :]
        x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=dev)[:, None], self._top["embed"])
        g = self.n_heads // self.n_kv
        for li, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
            kc, vc = self._k[li], self._v[li]
            kc[slot_idx, :, pos] = k[:, :, 0]
            vc[slot_idx, :, pos] = v[:, :, 0]
            keys, values = _read_cache(kc, rows, span), _read_cache(vc, rows, span)
            # One query position: the g query heads sharing a kv head are g query rows of
            # that head (the same attention as enable_gqa, ~25% cheaper in CPU SDPA).
            a = F.scaled_dot_product_attention(q.reshape(b, self.n_kv, g, self.head_dim), keys, values, attn_mask=mask)
            x = x + _linear(a.reshape(b, 1, self._q_dim), layer["o"], layer.get("o_b"))
            x = self._mlp_block(layer, x)
        self.lengths[slots] += 1
        return self._logits(x[:, 0])

    @torch.no_grad()
    def extend(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``chunks[i]`` after what slot ``slots[i]`` already holds; float32 logits [B, V]
        at each chunk's last token.

        This is the prefix-cache path: a slot keeps a conversation's keys and values
        between turns, and the next turn computes only its new tokens (positions
        ``lengths[slot]`` onwards), attending to the cached ones.  Chunks of different
        lengths share one right-padded forward; pad rows write no cache entries.
        Raises ValueError for an empty chunk, one that would overflow the slot, or an
        id outside the vocabulary.
        """
        self._check_ready(slots)
        b = len(slots)
        if b != len(chunks) or b == 0:
            raise ValueError(f"extend needs one chunk per slot, got {len(chunks)} chunks for {b} slots")
        slot_host = torch.tensor(list(slots), dtype=torch.long)
        start = self.lengths[slot_host].clone()
        lens = torch.tensor([len(c) for c in chunks], dtype=torch.long)
        for row, c in enumerate(chunks):
            if not c or int(start[row]) + len(c) > self.max_len:
                raise ValueError(
                    f"chunk {row} has {len(c)} tokens after {int(start[row])} cached; "
                    f"must be 1..{self.max_len - int(start[row])}"
                )
            if (i := first_outside_vocab(c, self.vocab_size)) is not None:
                raise ValueError(f"chunk {row} position {i}: token id {c[i]} outside vocab [0, {self.vocab_size})")
        t = int(lens.max())
        ids = torch.zeros(b, t, dtype=torch.long)
        for row, c in enumerate(chunks):
            ids[row, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
        col = torch.arange(t)
        pos = start[:, None] + col[None, :]  # [B, T] absolute positions
        real = col[None, :] < lens[:, None]  # [B, T] False on padding
        span = int((start + lens).max())
        dev = self.device
        pos_d = pos.clamp(max=self.max_len - 1).to(dev)
        cos, sin = self._cos[pos_d][:, None], self._sin[pos_d][:, None]  # [B, 1, T, d]
        # Row (b, t) sees cached keys and its own chunk up to itself; pad rows see the same
        # span (their outputs are dropped), so no row is fully masked.
        # Keys before the earliest chunk start are visible to every row: only the columns
        # from there on need comparing.
        lo = int(start.min())
        mask = torch.zeros(b, 1, t, span, dtype=self.dtype)
        mask[..., lo:].masked_fill_((torch.arange(lo, span)[None, None, :] > pos[:, :, None])[:, None], float("-inf"))
        mask = mask.to(dev)
        w_rows = torch.arange(b)[:, None].expand(b, t)[real]
        w_slots, w_pos, w_cols = slot_host[w_rows].to(dev), pos[real].to(dev), col[None, :].expand(b, t)[real].to(dev)
        w_rows = w_rows.to(dev)
        rows = _cache_rows(list(slots), slot_host.to(dev))
        x = F.embedding(ids.to(dev), self._top["embed"])
        for li, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
            kc, vc = self._k[li], self._v[li]
            kc[w_slots, :, w_pos] = k[w_rows, :, w_cols]
            vc[w_slots, :, w_pos] = v[w_rows, :, w_cols]
            keys, values = _read_cache(kc, rows, span), _read_cache(vc, rows, span)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + _linear(a.transpose(1, 2).reshape(b, t, self._q_dim), layer["o"], layer.get("o_b"))
            x = self._mlp_block(layer, x)
        self.lengths[slot_host] = start + lens
        last = (lens - 1).to(dev)
        return self._logits(x[torch.arange(b, device=dev), last])

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``slot`` (later ones are overwritten)."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"slot {slot} holds {int(self.lengths[slot])} tokens; cannot keep {length}")
        self.lengths[slot] = length

    def free(self, slot: int) -> None:
        """Forget a slot's sequence (its cache rows are simply overwritten later)."""
        self.lengths[slot] = 0


Qwen3Engine = DecoderEngine
"""An alias of `DecoderEngine`, kept for callers that import it by this name."""
