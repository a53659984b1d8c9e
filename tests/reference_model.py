"""What every rank must hold, computed independently of mxload's planner and loader.

Written from docs/contract.md §2-§3 for the tests: it reads a checkpoint with the official
``safetensors`` library, converts each whole (unsharded) tensor with the numpy reference
in ``tests/independent_ref.py``, then cuts each rank's share by the SPEC's rules (vLLM's
rank order, pipeline split, qkv with kv-head replication, vocab padding, MoE TP or EP
placement) and lays it out as docs/contract.md §2.3 says. Nothing here imports ``orchestrator`` or
``workers``: the tests compare mxload's dumps against this, byte for byte.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from safetensors.torch import load_file

from tests.independent_ref import mx_quantize_ref, resolve_ref_bits

DTYPE_BITS = {
    "bf16": (np.uint16, torch.bfloat16),
    "fp16": (np.uint16, torch.float16),
    "fp32": (np.uint32, torch.float32),
}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: bool = False
    placement: str = "linear"

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp


class RefCheckpoint:
    """A checkpoint read with the official library, converted tensor by tensor on demand."""

    def __init__(self, path: str, dtype: str | None = None, scale_alg: int = 0) -> None:
        self.scale_alg = scale_alg
        """The MX scale rule every MX tensor is quantized with (docs/contract.md §2.2)."""
        with open(os.path.join(path, "config.json")) as f:
            self.config = json.load(f)
        index = os.path.join(path, "model.safetensors.index.json")
        files = (
            sorted(set(json.load(open(index))["weight_map"].values()))
            if os.path.exists(index)
            else ["model.safetensors"]
        )
        self.tensors: dict[str, torch.Tensor] = {}
        for f in files:
            self.tensors.update(load_file(os.path.join(path, f)))
        stats = [os.stat(os.path.join(path, f)) for f in files]
        self.stamp = (
            os.path.realpath(path),
            tuple((f, st.st_size, st.st_mtime_ns) for f, st in zip(files, stats, strict=True)),
        )
        """The files' identity when read: equal stamps, equal tensors (a cache key)."""
        qc = self.config.get("quantization_config") or {}
        self.quant = "none"
        if "fp8" in str(qc.get("quant_method", "")):
            self.quant = "block_fp8"
            self.block = tuple(qc["weight_block_size"])
        td = str(self.config.get("torch_dtype", "bfloat16"))
        self.dtype = dtype or {"float16": "fp16", "float32": "fp32"}.get(td, "bf16")

    def quantized(self, module: str) -> bool:
        return self.tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn

    @cache  # noqa: B019 - one instance per test checkpoint
    def resolved(self, module: str) -> np.ndarray:
        """docs/contract.md §2.1 of the whole tensor: model-dtype bit patterns [N, K]."""
        w = self.tensors[f"{module}.weight"].view(torch.uint8).numpy()
        s = self.tensors[f"{module}.weight_scale_inv"].numpy()
        return resolve_ref_bits(
            w, s, row0=0, col0=0, block_n=self.block[0], block_k=self.block[1], dtype=self.dtype
        )

    def values(self, module: str) -> np.ndarray:
        """Exact float64 values of the resolved (or unquantized) tensor."""
        if self.quantized(module):
            bits = self.resolved(module)
            np_bits, tdt = DTYPE_BITS[self.dtype]
            t = torch.from_numpy(bits.view(np_bits).astype(np_bits).copy()).view(tdt)
            return t.to(torch.float64).numpy()
        return self.tensors[f"{module}.weight"].to(torch.float64).numpy()

    def model_bytes(self, module: str) -> np.ndarray:
        """The resolved tensor as raw model-dtype bytes viewed [N, K*itemsize]."""
        if self.quantized(module):
            b = np.ascontiguousarray(self.resolved(module))
        else:
            b = self.tensors[f"{module}.weight"].contiguous().view(torch.uint8).numpy()
            return b.reshape(b.shape[0], -1)
        return b.view(np.uint8).reshape(b.shape[0], -1)


def coords(layout: Layout, rank: int) -> tuple[int, int, int]:
    tp_rank = rank % layout.tp
    pp_rank = (rank // layout.tp) % layout.pp
    dp_rank = rank // (layout.tp * layout.pp)
    return dp_rank, pp_rank, tp_rank


def stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    base, rem = divmod(num_layers, pp)
    sizes = [base] * pp
    for i in range(rem):  # extras to the stages just before the last, counting backwards
        sizes[pp - 2 - i if pp >= 2 else 0] += 1
    start = sum(sizes[:stage])
    return list(range(start, start + sizes[stage]))


def experts_of(num_experts: int, ep: int, ep_rank: int, placement: str) -> list[int]:
    base, rem = divmod(num_experts, ep)
    count = base + (1 if ep_rank < rem else 0)
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep))
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + count))


def _pack_scale(scale: np.ndarray) -> np.ndarray:
    n, g = scale.shape
    g2 = -(-g // 2)
    padded = np.zeros((n, 2 * g2), dtype=np.uint8)
    padded[:, :g] = scale
    return np.ascontiguousarray(padded.reshape(n, g2, 2).transpose(1, 0, 2))


_MX_ROWS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
"""Quantized rows by checkpoint stamp, scale rule, dtype and parts: the tests of a
module ask for the same ranks of the same checkpoints again and again (read-only)."""
_MX_ROWS_MAX = 256 * 2**20
_mx_rows_bytes = 0


def _mx_rows(
    ck: RefCheckpoint, parts: list[tuple[str, slice, slice]]
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated rows of the parts, MX-quantized: (payload [N,K], scale [N,K/32])."""
    global _mx_rows_bytes
    key = (
        ck.stamp,
        ck.scale_alg,
        ck.dtype,
        tuple((m, r.start, r.stop, r.step, c.start, c.stop, c.step) for m, r, c in parts),
    )
    got = _MX_ROWS.get(key)
    if got is None:
        vals = np.concatenate([ck.values(m)[r, c] for m, r, c in parts], axis=0)
        got = mx_quantize_ref(vals, ck.scale_alg)
        for a in got:
            a.setflags(write=False)
        while _MX_ROWS and _mx_rows_bytes > _MX_ROWS_MAX:
            _mx_rows_bytes -= sum(a.nbytes for a in _MX_ROWS.pop(next(iter(_MX_ROWS))))
        _MX_ROWS[key] = got
        _mx_rows_bytes += got[0].nbytes + got[1].nbytes
    return got


def _dense_rows(ck: RefCheckpoint, parts: list[tuple[str, slice, slice]]) -> np.ndarray:
    """Concatenated rows as raw bytes of the model dtype (quantized parts resolved)."""
    out = []
    for m, r, c in parts:
        b = ck.model_bytes(m)
        item = b.shape[1] // ck.tensors[f"{m}.weight"].shape[1]
        out.append(b[r, c.start * item : c.stop * item])
    return np.concatenate(out, axis=0)


def _linear(
    ck: RefCheckpoint,
    name: str,
    parts: list[tuple[str, slice, slice]],
    out: dict,
    like: RefCheckpoint,
) -> None:
    k = parts[0][2].stop - parts[0][2].start
    quant = like.quantized(parts[0][0])
    if quant and k % 32 == 0:
        payload, scale = _mx_rows(ck, parts)
        out[f"{name}.weight"] = np.ascontiguousarray(payload.T)
        out[f"{name}.weight_scale"] = _pack_scale(scale)
    else:
        out[f"{name}.weight"] = _dense_rows(ck, parts)


def expected_rank(
    ck: RefCheckpoint, layout: Layout, rank: int, like: RefCheckpoint | None = None
) -> dict[str, np.ndarray]:
    """name -> raw bytes (as a uint8 array of the tensor's layout) that ``rank`` holds.

    ``like``: the checkpoint first loaded, whose quantization decides the layouts (a
    reload from a BF16 checkpoint quantizes into the MX buffers the FP8 load made)."""
    like = like or ck
    cfg = ck.config
    dp_rank, pp_rank, tp_rank = coords(layout, rank)
    tp = layout.tp
    hidden = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // nh
    layers = stage_layers(cfg["num_hidden_layers"], layout.pp, pp_rank)
    out: dict[str, np.ndarray] = {}
    full = slice(None)
    for i in layers:
        p = f"model.layers.{i}"
        qn = nh // tp * hd
        q = (f"{p}.self_attn.q_proj", slice(tp_rank * qn, (tp_rank + 1) * qn), slice(0, hidden))
        if tp <= nkv:
            kv_shard, kvn = tp_rank, nkv // tp * hd
        else:
            kv_shard, kvn = tp_rank // (tp // nkv), hd
        kv = slice(kv_shard * kvn, (kv_shard + 1) * kvn)
        _linear(
            ck,
            f"{p}.self_attn.qkv_proj",
            [
                q,
                (f"{p}.self_attn.k_proj", kv, slice(0, hidden)),
                (f"{p}.self_attn.v_proj", kv, slice(0, hidden)),
            ],
            out,
            like,
        )
        kq = nh * hd // tp
        _linear(
            ck,
            f"{p}.self_attn.o_proj",
            [(f"{p}.self_attn.o_proj", full, slice(tp_rank * kq, (tp_rank + 1) * kq))],
            out,
            like,
        )
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
        ):
            key = f"{p}.{norm}.weight"
            if key in ck.tensors:
                out[key] = ck.tensors[key].contiguous().view(torch.uint8).numpy()
        n_exp = cfg.get("num_experts", 0) or 0
        is_moe = (
            n_exp > 0
            and i not in (cfg.get("mlp_only_layers") or [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        if is_moe:
            out[f"{p}.mlp.gate.weight"] = (
                ck.tensors[f"{p}.mlp.gate.weight"].contiguous().view(torch.uint8).numpy()
            )
            inter = cfg["moe_intermediate_size"]
            if layout.ep:
                ep = layout.dp * tp
                experts = experts_of(n_exp, ep, dp_rank * tp + tp_rank, layout.placement)
                rows, cols = slice(0, inter), slice(0, inter)
                il = inter
            else:
                t = layout.dp * tp
                mr = dp_rank * tp + tp_rank
                il = inter // t
                experts = list(range(n_exp))
                rows = cols = slice(mr * il, (mr + 1) * il)
            mx = (
                like.quantized(f"{p}.mlp.experts.0.gate_proj") and hidden % 32 == 0 and il % 32 == 0
            )
            w13, s13, w2, s2 = [], [], [], []
            for e in experts:
                pe = f"{p}.mlp.experts.{e}"
                g_u = [
                    (f"{pe}.gate_proj", rows, slice(0, hidden)),
                    (f"{pe}.up_proj", rows, slice(0, hidden)),
                ]
                dn = [(f"{pe}.down_proj", full, cols)]
                if mx:
                    a, b = _mx_rows(ck, g_u)
                    w13.append(a.T)
                    s13.append(_pack_scale(b))
                    a, b = _mx_rows(ck, dn)
                    w2.append(a.T)
                    s2.append(_pack_scale(b))
                else:
                    w13.append(_dense_rows(ck, g_u))
                    w2.append(_dense_rows(ck, dn))
            out[f"{p}.mlp.experts.w13_weight"] = np.ascontiguousarray(np.stack(w13))
            out[f"{p}.mlp.experts.w2_weight"] = np.ascontiguousarray(np.stack(w2))
            if mx:
                out[f"{p}.mlp.experts.w13_weight_scale"] = np.stack(s13)
                out[f"{p}.mlp.experts.w2_weight_scale"] = np.stack(s2)
        else:
            inter = cfg["intermediate_size"]
            il = inter // tp
            rows = slice(tp_rank * il, (tp_rank + 1) * il)
            _linear(
                ck,
                f"{p}.mlp.gate_up_proj",
                [
                    (f"{p}.mlp.gate_proj", rows, slice(0, hidden)),
                    (f"{p}.mlp.up_proj", rows, slice(0, hidden)),
                ],
                out,
                like,
            )
            _linear(
                ck,
                f"{p}.mlp.down_proj",
                [(f"{p}.mlp.down_proj", full, slice(tp_rank * il, (tp_rank + 1) * il))],
                out,
                like,
            )

    vocab = cfg["vocab_size"]
    vp = -(-vocab // 64) * 64
    per = vp // tp

    def vocab_shard(src: str) -> np.ndarray:
        t = ck.tensors[src]
        item = t.element_size()
        rows = np.zeros((per, t.shape[1] * item), dtype=np.uint8)
        lo, hi = tp_rank * per, min((tp_rank + 1) * per, vocab)
        if hi > lo:
            rows[: hi - lo] = t[lo:hi].contiguous().view(torch.uint8).numpy()
        return rows

    if pp_rank == 0:
        out["model.embed_tokens.weight"] = vocab_shard("model.embed_tokens.weight")
    if pp_rank == layout.pp - 1:
        out["model.norm.weight"] = (
            ck.tensors["model.norm.weight"].contiguous().view(torch.uint8).numpy()
        )
        src = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
        out["lm_head.weight"] = vocab_shard(src)
    return out


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def compare_rank(expected: dict[str, np.ndarray], got: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ (missing, extra, or other bytes). E4M3 NaN bytes 0x7F/0xFF equal."""
    problems = []
    for name in sorted(set(expected) | set(got)):
        if name not in got:
            problems.append(f"{name}: missing")
            continue
        if name not in expected:
            problems.append(f"{name}: unexpected")
            continue
        a = np.ascontiguousarray(expected[name]).view(np.uint8).reshape(-1)
        b = as_bytes(got[name])
        if a.shape != b.shape:
            problems.append(f"{name}: {b.shape[0]} bytes, expected {a.shape[0]}")
            continue
        if got[name].dtype == torch.float8_e4m3fn:
            same = (a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))
        else:
            same = a == b
        if not same.all():
            problems.append(f"{name}: {int((~same).sum())} bytes differ")
    return problems
