"""Run deepinfer's emitted HLO in XLA (jaxlib, CPU) and compare with deepinfer's CPU backend.

What: for every graph in a `deepinfer lower` output directory that has inputs, this parses
`NAME.hlo.pb` with XLA, compiles it for the CPU, runs it on `NAME.inputs.safetensors`, and checks
every output against `NAME.outputs.safetensors` (what deepinfer's own CPU backend computed from
the same inputs): float outputs within --tol (max abs), integer outputs (sampled tokens)
identical. With --reference (a fixture's reference.json, transformers' logits), it also checks
that the decode graphs' row-0 logits equal transformers' logits at the last position.

Why: neuronx-cc's front end is XLA's, so a module XLA parses and runs identically is the closest
check of our lowering that needs no Trainium. Each module runs in a child process, because a
malformed module can abort jaxlib (SIGABRT) instead of raising.

How (the README's test command does this for every fixture):

    .venv/bin/python scripts/xla_check.py OUT_DIR [--reference fixtures/tiny-v3/reference.json]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 safetensors load)
import numpy as np


def compile_module(pb: bytes):
    """Parses a serialized HloModuleProto with XLA and compiles it for the CPU. Returns a function
    from numpy arrays (one per parameter, in order) to numpy arrays (one per root tuple element).
    Shared with scripts/xla_conformance.py."""
    import jax
    from jax._src.lib import xla_client as xc

    try:
        from jax._src import xla_bridge

        backend = xla_bridge.get_backend("cpu")
    except Exception:  # pragma: no cover - older/newer jax layouts
        backend = jax.extend.backend.get_backend("cpu")
    comp = xc.XlaComputation(pb)
    mlir = xc._xla.mlir.xla_computation_to_mlir_module(comp)
    dev = backend.local_devices()[0]
    opts = xc.CompileOptions()
    if hasattr(backend, "compile_and_load"):
        exe = backend.compile_and_load(mlir, xc.DeviceList((dev,)), opts)
    else:
        exe = backend.compile(mlir, opts)

    def run(arrays):
        res = exe.execute_sharded([jax.device_put(a, dev) for a in arrays])
        return [np.asarray(o[0]) for o in res.disassemble_into_single_device_arrays()]

    return run


def run_module(pb_path: str, inputs_path: str, names: list[str], out_path: str) -> None:
    """Child process: compile and run one module, save its outputs as .npz."""
    from safetensors.numpy import load_file

    run = compile_module(Path(pb_path).read_bytes())
    values = load_file(inputs_path)
    # .npz cannot hold ml_dtypes' bfloat16 (it reads back as raw bytes): widen such outputs
    # to float32, which is exact; the check compares them against the bf16 CPU outputs.
    outputs = run([values[n] for n in names])
    np.savez(out_path, *[o.astype(np.float32) if o.dtype.name == "bfloat16" else o for o in outputs])


def check_graph(out_dir: Path, g: dict, tol: float, reference, reference_tol: float) -> list[str]:
    """Returns a list of failures (empty when the graph matches)."""
    from safetensors.numpy import load_file

    names = [p["name"] for p in g["parameters"]]
    npz = out_dir / f"{g['name']}.xla.npz"
    child = subprocess.run(
        [sys.executable, __file__, "--child", str(out_dir / g["hlo"]), str(out_dir / g["inputs"]), str(npz), *names],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        return [f"{g['name']}: XLA failed (exit {child.returncode}): {child.stderr.strip()[-2000:]}"]
    got = np.load(npz)
    want = load_file(str(out_dir / g["cpu_outputs"]))
    failures = []
    for o in g["outputs"]:
        x, y = got[f"arr_{o['index']}"], want[o["name"]]
        if x.shape != y.shape:
            failures.append(f"{g['name']}.{o['name']}: shape {x.shape} vs {y.shape}")
        elif y.dtype.name in ("bfloat16", "float16"):
            # A value both computed in f32 and then rounded to 16 bits may round to neighbouring
            # 16-bit values when the f32 results differ in their last bits: allow one unit in
            # the last place of the 16-bit type on top of the tolerance.
            ulp = 2.0**-7 if y.dtype.name == "bfloat16" else 2.0**-10
            a, b = x.astype(np.float64), y.astype(np.float64)
            excess = float(np.max(np.abs(a - b) - (tol + ulp * np.abs(b)))) if x.size else 0.0
            diff = float(np.max(np.abs(a - b))) if x.size else 0.0
            print(f"  {g['name']}.{o['name']}: max |xla - cpu| = {diff:.3g} ({y.dtype.name})")
            if not excess <= 0.0:
                failures.append(f"{g['name']}.{o['name']}: differs by more than one {y.dtype.name} ulp + {tol}")
        elif np.issubdtype(y.dtype, np.floating):
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            print(f"  {g['name']}.{o['name']}: max |xla - cpu| = {diff:.3g}")
            if not diff <= tol:
                failures.append(f"{g['name']}.{o['name']}: max abs diff {diff} > {tol}")
        elif not np.array_equal(x, y):
            failures.append(f"{g['name']}.{o['name']}: {x.tolist()} != {y.tolist()}")
        else:
            print(f"  {g['name']}.{o['name']}: identical ({x.tolist() if x.size <= 8 else x.shape})")
    if reference is not None and g["kind"] == "decode":
        k = [o["name"] for o in g["outputs"]].index("logits")
        row0 = got[f"arr_{k}"][0].astype(np.float64)
        ref = np.asarray(reference["logits"][-1], dtype=np.float64)
        diff = float(np.max(np.abs(row0 - ref)))
        print(f"  {g['name']}: row 0 vs transformers, max |diff| = {diff:.3g} (allowed {reference_tol:.3g})")
        if not diff <= reference_tol:
            failures.append(f"{g['name']}: row-0 logits differ from transformers by {diff}")
    return failures


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_module(sys.argv[2], sys.argv[3], sys.argv[5:], sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--reference", type=Path, help="a fixture's reference.json")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument(
        "--peer",
        type=Path,
        help="a reference-bf16.json: decode logits may then differ from --reference by as much as "
        "transformers' own bf16 run does at that position (instead of --tol)",
    )
    args = ap.parse_args()
    manifest = json.loads((args.out_dir / "manifest.json").read_text())
    reference = json.loads(args.reference.read_text()) if args.reference else None
    reference_tol = args.tol
    if args.peer is not None and reference is not None:
        peer = json.loads(args.peer.read_text())
        last = np.asarray(peer["logits"][-1], dtype=np.float64)
        reference_tol = float(np.max(np.abs(last - np.asarray(reference["logits"][-1], dtype=np.float64))))
    failures, checked = [], 0
    for g in manifest["graphs"]:
        if not g.get("inputs"):
            continue
        print(f"{g['name']}:")
        failures += check_graph(args.out_dir, g, args.tol, reference, reference_tol)
        checked += 1
    for f in failures:
        print("FAIL", f)
    passed = checked - len({f.split(':')[0].split('.')[0] for f in failures})
    print(f"xla_check: {passed} passed, {checked - passed} failed")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
