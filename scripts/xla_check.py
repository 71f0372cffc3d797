"""Run deepinfer's emitted HLO in XLA (jaxlib, CPU) and compare with deepinfer's CPU backend.

What: for every graph in a `deepinfer lower` output directory that has inputs, this parses
`NAME.hlo.pb` with XLA, compiles it for the CPU, runs it on `NAME.inputs.safetensors`, and checks
every output against `NAME.outputs.safetensors` (what deepinfer's own CPU backend computed from
the same inputs): float outputs within --tol (max abs), integer outputs (sampled tokens)
identical. With --reference (a fixture's reference.json, transformers' logits at every
position), it also checks every logits row the manifest's `reference_positions` maps to a
position against transformers' logits there: decode's row 0, every real row of the prefill
graph, and every real row of the packed prefill graph (two sequences in one step).

Why: neuronx-cc's front end is XLA's, so a module XLA parses and runs identically is the closest
check of our lowering that needs no Trainium. Each module runs in a child process, because a
malformed module can abort jaxlib (SIGABRT) instead of raising; up to --jobs of them at once.

Tensor parallelism: when the manifest says `"tp": N` with N > 1 (`deepinfer lower --tp N`),
each module is compiled with N replicas (`CompileOptions.num_replicas = N`, replica r on CPU
device r, the child process started with `XLA_FLAGS=--xla_force_host_platform_device_count=N`)
and run once on every rank's inputs (`NAME.rank{r}.inputs.safetensors`): its all-reduce and
all-gather meet across the replicas. Every rank's outputs, the updated cache root included, must
match the CPU backend's (all ranks compute the same values, but the logits: each rank returns
its slice of the vocabulary's columns, checked against those columns); with --reference, the
ranks' slices joined into whole rows must match transformers'.

How (the README's test command does this for every fixture):

    .venv/bin/python scripts/xla_check.py OUT_DIR [--reference fixtures/tiny-v3/reference.json]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 safetensors load)
import numpy as np


def compile_module(pb: bytes, replicas: int = 1):
    """Parses a serialized HloModuleProto with XLA and compiles it for the CPU. Returns a function
    from numpy arrays (one per parameter, in order) to numpy arrays (one per root tuple element).
    Shared with scripts/xla_conformance.py.

    With replicas > 1 (the process must have been started with at least that many host devices,
    see `replica_env`), the module is compiled for that many replicas, replica r on CPU device r,
    and the function takes one list of arrays per replica and returns one list of outputs per
    replica. jax 0.10.2's `execute_sharded` takes one jax Array per parameter, whose shard on
    device r is replica r's buffer: so each parameter's per-replica arrays are put on their
    devices and assembled into one array sharded on its leading axis (`NamedSharding` over a
    one-axis mesh of the devices, `make_array_from_single_device_arrays`); the results
    disassemble into one array per device, i.e. per replica."""
    import jax
    from jax._src.lib import xla_client as xc

    try:
        from jax._src import xla_bridge

        backend = xla_bridge.get_backend("cpu")
    except Exception:  # pragma: no cover - older/newer jax layouts
        backend = jax.extend.backend.get_backend("cpu")
    comp = xc.XlaComputation(pb)
    mlir = xc._xla.mlir.xla_computation_to_mlir_module(comp)
    devs = backend.local_devices()[:replicas]
    if len(devs) < replicas:
        raise RuntimeError(
            f"{replicas} replicas need {replicas} CPU devices, jax has {len(devs)} "
            f"(start the process with {replica_env(replicas)['XLA_FLAGS']!r})"
        )
    opts = xc.CompileOptions()
    if replicas > 1:
        opts.num_replicas = replicas
        opts.num_partitions = 1
        opts.device_assignment = xc.DeviceAssignment.create(np.arange(replicas).reshape(replicas, 1))
    if hasattr(backend, "compile_and_load"):
        exe = backend.compile_and_load(mlir, xc.DeviceList(tuple(devs)), opts)
    else:
        exe = backend.compile(mlir, opts)

    if replicas == 1:

        def run(arrays):
            res = exe.execute_sharded([jax.device_put(a, devs[0]) for a in arrays])
            return [np.asarray(o[0]) for o in res.disassemble_into_single_device_arrays()]

        return run

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(devs), ("replica",)), PartitionSpec("replica"))

    def stacked(per_replica):
        if per_replica[0].ndim == 0:
            raise ValueError("a scalar parameter cannot be split on a leading axis over replicas")
        first = per_replica[0]
        shape = (replicas * first.shape[0],) + first.shape[1:]
        parts = [jax.device_put(a, d) for a, d in zip(per_replica, devs)]
        return jax.make_array_from_single_device_arrays(shape, sharding, parts)

    def run_replicated(per_replica_arrays):
        if len(per_replica_arrays) != replicas:
            raise ValueError(f"{len(per_replica_arrays)} replicas' inputs for {replicas} replicas")
        params = [stacked(list(p)) for p in zip(*per_replica_arrays)]
        res = exe.execute_sharded(params)
        outputs = res.disassemble_into_single_device_arrays()  # [output][replica]
        return [[np.asarray(o[r]) for o in outputs] for r in range(replicas)]

    return run_replicated


def replica_env(replicas: int) -> dict:
    """The environment of a child process that runs a module with `replicas` replicas: jax's CPU
    client makes as many host devices as XLA_FLAGS asks for when it starts, so this must be set
    before jax is imported.

    The child also compiles with LLVM's optimizations off (`--xla_backend_optimization_level=0`,
    unless XLA_FLAGS already sets a level): what is checked is the module's meaning, which XLA's
    HLO passes and code generation keep at every level, not the speed of the code XLA makes for
    a tiny model; it takes a V4 step graph's compile from about 13 s to 11 (measured on a 2-core
    machine like CI's, where the compiles are most of the XLA conformance's time)."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0"
    if replicas > 1:
        flags += f" --xla_force_host_platform_device_count={replicas}"
    env["XLA_FLAGS"] = flags.strip()
    return env


def run_module(pb_path: str, inputs_paths: list[str], names: list[str], out_path: str) -> None:
    """Child process: compile and run one module (with one replica per inputs file), save its
    outputs as .npz (`r{replica}_{output index}`)."""
    from safetensors.numpy import load_file

    replicas = len(inputs_paths)
    run = compile_module(Path(pb_path).read_bytes(), replicas)
    values = [load_file(p) for p in inputs_paths]
    if replicas == 1:
        per_replica = [run([values[0][n] for n in names])]
    else:
        per_replica = run([[v[n] for n in names] for v in values])
    # .npz cannot hold ml_dtypes' bfloat16 (it reads back as raw bytes): widen such outputs
    # to float32, which is exact; the check compares them against the bf16 CPU outputs.
    np.savez(
        out_path,
        **{
            f"r{r}_{i}": o.astype(np.float32) if o.dtype.name == "bfloat16" else o
            for r, outputs in enumerate(per_replica)
            for i, o in enumerate(outputs)
        },
    )


def graph_inputs(g: dict, tp: int) -> list[str]:
    """The graph's inputs files, one per rank (one when unsharded); empty when none were
    written."""
    if tp > 1:
        files = g.get("rank_inputs") or []
        if files and len(files) != tp:
            raise ValueError(f"{g['name']}: {len(files)} rank inputs files for tp {tp}")
        return files
    return [g["inputs"]] if g.get("inputs") else []


def start_graph(out_dir: Path, g: dict, tp: int) -> subprocess.Popen:
    """Starts the child process that compiles and runs graph `g` in XLA (its outputs go to
    `NAME.xla.npz`, what it prints to `NAME.xla.log`, so that children running side by side never
    block on a full pipe)."""
    names = [p["name"] for p in g["parameters"]]
    npz = out_dir / f"{g['name']}.xla.npz"
    inputs = [str(out_dir / f) for f in graph_inputs(g, tp)]
    with open(out_dir / f"{g['name']}.xla.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, __file__, "--child", str(out_dir / g["hlo"]), str(npz), str(len(inputs)), *inputs, *names],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=replica_env(tp),
        )


def check_graph(out_dir: Path, g: dict, child: subprocess.Popen, tol: float, reference, reference_tol, tp: int, vocab: int) -> list[str]:
    """Waits for `child` (`start_graph`'s for `g`) and returns a list of failures (empty when the
    graph matches). With tp > 1, every rank's outputs are checked (labelled `@rank{r}`)."""
    from safetensors.numpy import load_file

    npz = out_dir / f"{g['name']}.xla.npz"
    if child.wait() != 0:
        log = (out_dir / f"{g['name']}.xla.log").read_text(errors="replace")
        return [f"{g['name']}: XLA failed (exit {child.returncode}): {log.strip()[-2000:]}"]
    got = np.load(npz)
    want = load_file(str(out_dir / g["cpu_outputs"]))
    per_rank = [{o["name"]: got[f"r{r}_{o['index']}"] for o in g["outputs"]} for r in range(tp)]
    failures = []
    if tp > 1 and "logits" in want:
        failures += check_padding(g["name"], per_rank, want["logits"], vocab)
    for r, outs in enumerate(per_rank):
        label = g["name"] if tp == 1 else f"{g['name']}@rank{r}"
        failures += check_outputs(label, real_view(outs, r, tp, vocab), rank_view(want, r, tp, vocab), tol)
    if reference is not None and g.get("reference_positions") is not None:
        # Each rank's logits are its vocabulary slice; transformers' rows are whole.
        logits = np.concatenate([outs["logits"] for outs in per_rank], axis=1)[:, :vocab]
        failures += check_reference(g["name"], logits, g["reference_positions"], reference, reference_tol)
    return failures


def check_padding(label: str, per_rank: list, want, vocab: int) -> list[str]:
    """When the ranks' slices together are wider than the vocabulary (`--tp` does not divide
    it), the last columns are padding: every rank's and the CPU backend's logits there must be
    -inf (never sampled), and only the real columns are compared after this."""
    joined = np.concatenate([outs["logits"] for outs in per_rank], axis=1)
    if joined.shape != want.shape:
        return [f"{label}.logits: joined shape {joined.shape} vs {want.shape}"]
    if joined.shape[1] == vocab:
        return []
    pad = joined.shape[1] - vocab
    if not (np.all(np.isneginf(joined[:, vocab:])) and np.all(np.isneginf(want[:, vocab:]))):
        return [f"{label}.logits: the {pad} padding columns past the vocabulary are not all -inf"]
    print(f"  {label}.logits: {pad} padding columns past the vocabulary ({vocab}), all -inf")
    return []


def real_view(outs: dict, rank: int, tp: int, vocab: int) -> dict:
    """Rank `rank`'s outputs with its logits cut to the columns inside the vocabulary."""
    if tp == 1 or "logits" not in outs:
        return outs
    width = outs["logits"].shape[1]
    real = max(0, min(width, vocab - rank * width))
    return {**outs, "logits": outs["logits"][:, :real]}


def rank_view(want: dict, rank: int, tp: int, vocab: int) -> dict:
    """What rank `rank` of `tp` must output: the CPU backend's outputs, whose logits are whole
    rows (padding included), with the logits cut to the rank's vocabulary slice (columns
    `rank * width` onwards, `width` the rows a rank holds), inside the vocabulary."""
    if tp == 1 or "logits" not in want:
        return want
    width = want["logits"].shape[1] // tp
    end = min((rank + 1) * width, vocab)
    return {**want, "logits": want["logits"][:, rank * width:max(end, rank * width)]}


def check_outputs(label: str, got: dict, want: dict, tol: float) -> list[str]:
    """Checks one rank's outputs against the CPU backend's: floats within `tol` (16-bit floats
    one unit in the last place more), integers identical."""
    failures = []
    for name, x in got.items():
        y = want[name]
        if x.shape != y.shape:
            failures.append(f"{label}.{name}: shape {x.shape} vs {y.shape}")
        elif y.dtype.name in ("bfloat16", "float16"):
            # A value both computed in f32 and then rounded to 16 bits may round to neighbouring
            # 16-bit values when the f32 results differ in their last bits: allow one unit in
            # the last place of the 16-bit type on top of the tolerance.
            ulp = 2.0**-7 if y.dtype.name == "bfloat16" else 2.0**-10
            a, b = x.astype(np.float64), y.astype(np.float64)
            excess = float(np.max(np.abs(a - b) - (tol + ulp * np.abs(b)))) if x.size else 0.0
            diff = float(np.max(np.abs(a - b))) if x.size else 0.0
            print(f"  {label}.{name}: max |xla - cpu| = {diff:.3g} ({y.dtype.name})")
            if not excess <= 0.0:
                failures.append(f"{label}.{name}: differs by more than one {y.dtype.name} ulp + {tol}")
        elif np.issubdtype(y.dtype, np.floating):
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            print(f"  {label}.{name}: max |xla - cpu| = {diff:.3g}")
            if not diff <= tol:
                failures.append(f"{label}.{name}: max abs diff {diff} > {tol}")
        elif not np.array_equal(x, y):
            failures.append(f"{label}.{name}: {x.tolist()} != {y.tolist()}")
        else:
            print(f"  {label}.{name}: identical ({x.tolist() if x.size <= 8 else x.shape})")
    return failures


def check_reference(label: str, logits, positions, reference, reference_tol) -> list[str]:
    """Every real logits row against transformers' logits at the position it predicts
    (decode's row 0, and every position of the prefill graphs, the packed one included),
    `reference_tol(position)` allowed."""
    worst, worst_excess = 0.0, -np.inf
    for row, pos in enumerate(positions):
        if pos is None:
            continue
        # A model cut to a smaller vocabulary than the reference's (the padded-vocabulary
        # check): its logits are the reference's first columns.
        ref = np.asarray(reference["logits"][pos], dtype=np.float64)[: logits.shape[1]]
        diff = float(np.max(np.abs(logits[row].astype(np.float64) - ref)))
        worst = max(worst, diff)
        worst_excess = max(worst_excess, diff - reference_tol(pos))
    print(f"  {label}: logits vs transformers, max |diff| = {worst:.3g}")
    if not worst_excess <= 0.0:
        return [f"{label}: logits differ from transformers beyond the allowed tolerance"]
    return []


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        pb, npz, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
        run_module(pb, sys.argv[5 : 5 + count], sys.argv[5 + count :], npz)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--reference", type=Path, help="a fixture's reference.json")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument(
        "--peer",
        type=Path,
        help="a reference-bf16.json: logits may then differ from --reference by as much as "
        "transformers' own bf16 run does at that position (instead of --tol)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="graphs compiled and run at once, each in its own process (default: the CPU count)",
    )
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    manifest = json.loads((args.out_dir / "manifest.json").read_text())
    reference = json.loads(args.reference.read_text()) if args.reference else None
    def reference_tol(pos: int) -> float:
        return args.tol

    if args.peer is not None and reference is not None:
        peer = json.loads(args.peer.read_text())

        def reference_tol(pos: int) -> float:
            # As far as transformers' own bf16 run is from its f32 run at that position.
            a = np.asarray(peer["logits"][pos], dtype=np.float64)
            return float(np.max(np.abs(a - np.asarray(reference["logits"][pos], dtype=np.float64))))

    tp = int(manifest.get("tp", 1))
    vocab = int(manifest["vocab_size"])
    graphs = [g for g in manifest["graphs"] if graph_inputs(g, tp)]
    # Up to --jobs children compile side by side (XLA's compile of one module leaves cores idle);
    # the checks and what they print stay in the manifest's order.
    children = [start_graph(args.out_dir, g, tp) for g in graphs[: args.jobs]]
    failures, checked = [], 0
    for i, g in enumerate(graphs):
        child = children[i]
        child.wait()
        if i + args.jobs < len(graphs):
            children.append(start_graph(args.out_dir, graphs[i + args.jobs], tp))
        print(f"{g['name']}:" if tp == 1 else f"{g['name']} ({tp} replicas):", flush=True)
        failures += check_graph(args.out_dir, g, child, args.tol, reference, reference_tol, tp, vocab)
        checked += 1
    for f in failures:
        print("FAIL", f)
    passed = checked - len({f.split(':')[0].split('.')[0].split('@')[0] for f in failures})
    print(f"xla_check: {passed} passed, {checked - passed} failed")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
