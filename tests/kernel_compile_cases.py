"""seqmesh's Triton kernels compiled for a Hopper GPU (sm_90) on this CPU, with the launch settings the runtime
would use (``seqmesh.kernels.sparse_latent_triton._sizes``, ``seqmesh.linear_attention.carry_triton._sizes``), and
each compiled kernel's registers and stack (spills) as ``cuobjdump`` reports them. Triton's wheel carries ptxas and
cuobjdump; no GPU is needed. Run in a process without ``TRITON_INTERPRET`` (the interpreter's kernels do not
compile): ``python kernel_compile_cases.py`` prints one JSON object (DeepSeek Sparse Attention's kernels), and
``python kernel_compile_cases.py carry`` the delta rule's carry's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch


def _usage(compiled) -> dict:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "shared": compiled.metadata.shared}


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from seqmesh.kernels import sparse_latent_triton as k

    target = GPUTarget("cuda", 90, 32)
    ints = {"T": "i32", "L": "i32", "H": "i32", "K": "i32", "scale": "fp32"}
    out = {}
    # (name, heads, latent R, rotary Dr, dtype): DeepSeek-V3.2's layer (128 heads, 512 + 64), DeepSeek-V4's (64 heads of
    # 512, keys and values one row), and V3.2's in float32
    for name, heads, rank, rot, dtype in [("v3.2 bf16", 128, 512, 64, torch.bfloat16), ("v4 bf16", 64, 512, 0,
                                                                                          torch.bfloat16),
                                          ("v3.2 fp32", 128, 512, 64, torch.float32)]:
        t = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
        query = torch.empty(1, 1, heads, rank + rot, device="meta", dtype=dtype)
        for kind, fn, block_k in [("forward", k._forward, k.BLOCK_K), ("backward", k._backward, k.BACKWARD_BLOCK_K)]:
            sizes = k._sizes(query, rank, block_k)
            warps = sizes.pop("num_warps")
            if kind == "forward":
                sizes["HAS_SINK"] = True
                pointers = {"Q": t, "ROW": t, "IDX": "*i64", "SINK": "*fp32", "O": t, "LSE": "*fp32"}
            else:
                pointers = {"Q": t, "ROW": t, "IDX": "*i64", "O": t, "DO": t, "LSE": "*fp32", "DQ": t, "DROW": "*fp32"}
            signature = {**pointers, **ints, **{c: "constexpr" for c in sizes}}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=sizes), target=target,
                                      options={"num_warps": warps})
            out[f"{kind} {name}"] = _usage(compiled)
    # the indexer at DeepSeek-V3.2's 128-wide heads: float32 values, and a bf16 model's (tensor-core products)
    for name, t, dtype in [("index_scores v3.2", "*fp32", torch.float32), ("index_scores v3.2 bf16", "*bf16",
                                                                            torch.bfloat16)]:
        sizes = k.index_sizes(dtype, 128)
        warps = sizes.pop("num_warps")
        signature = {"Q": t, "KEYS": t, "W": "*fp32", "LIMIT": "*i64", "OUT": "*fp32", "L": "i32", "T": "i32",
                     "H": "i32", "scale": "fp32", **{c: "constexpr" for c in sizes}}
        compiled = triton.compile(ASTSource(fn=k._index_scores, signature=signature, constexprs=sizes), target=target,
                                  options={"num_warps": warps})
        out[name] = _usage(compiled)
    return out


def carry_report() -> dict:
    """The recurrent rules' loop kernels: the delta rule's carry (seqmesh.linear_attention.carry_triton) at the
    released sizes (chunks of 64, heads of 128 keys and values, a decay a head (Gated DeltaNet) or a state row
    (KDA)), and the scalar-decay scan's (decay_scan_triton)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from seqmesh.linear_attention import carry_triton as k

    target = GPUTarget("cuda", 90, 32)
    out = {}
    for rows in (1, 128):
        sizes = k._sizes(64, 128, 128, rows, True)
        launch = {"num_warps": sizes.pop("num_warps"), "num_stages": sizes.pop("num_stages")}
        for kind, fn, pointers in [
                ("forward", k._forward, ("U", "W", "KW", "DECAY", "INIT", "START", "END", "STATES", "VNEW", "FINALS")),
                ("backward", k._backward, ("DOUT", "INTRA", "KW", "W", "QR", "DECAY", "STATES", "VNEW", "DFINAL",
                                           "START", "END", "DVNEW", "DKW", "DDECAY", "DINIT"))]:
            types = {p: "*i32" if p in ("START", "END") else "*fp32" for p in pointers}
            signature = {**types, "N": "i32", "BH": "i32", **{c: "constexpr" for c in sizes}}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=sizes), target=target,
                                      options=launch)
            out[f"carry {kind} rows {rows}"] = _usage(compiled)
    from seqmesh.linear_attention import decay_scan_triton as scan

    for kind, fn, pointers in [("forward", scan._forward, ("WRITTEN", "DECAY", "INIT", "FIRST", "LAST", "ENTERING",
                                                           "FINALS")),
                               ("backward", scan._backward, ("D_ENTERING", "DECAY", "D_FINALS", "FIRST", "LAST",
                                                             "D_WRITTEN", "D_INIT"))]:
        sizes = {"BLOCK": scan.BLOCK, "HAS_INIT": True}
        types = {p: "*i32" if p in ("FIRST", "LAST") else "*fp32" for p in pointers}
        signature = {**types, "N": "i32", "H": "i32", "J": "i32", "SIZE": "i32", **{c: "constexpr" for c in sizes}}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=sizes), target=target,
                                  options={"num_warps": scan.WARPS})
        out[f"scan {kind}"] = _usage(compiled)
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(carry_report() if sys.argv[1:] == ["carry"] else report()))
