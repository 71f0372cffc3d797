"""Run the conformance cases' HLO in XLA (jaxlib, CPU): the suite's fourth executor.

What: for every case in tests/conformance/*.json, this compiles `CASE.hlo.pb` (the module
deepinfer's emitter wrote for the case's graph) with XLA, runs it on the case's inputs, and
compares each output with the case's expected values under the case's rule: the same cases and
the same rule tests/conformance.rs applies to the CPU backend, emit -> import -> CPU and nrt-sim.
A case may list `xla` in `known_failures`: it must then fail (a pass is reported as stale).

Why: neuronx-cc's front end is XLA's, so XLA running our HLO and matching numpy is the closest
check of the lowering that needs no Trainium. The HLO is ours: the Rust test writes it, this
script never builds a graph.

How (scripts/test.sh does this): write the modules, then check them.

    DEEPINFER_CONFORMANCE_OUT=/tmp/hlo cargo test --test conformance
    .venv/bin/python scripts/xla_conformance.py tests/conformance /tmp/hlo

The cases run in a child process, because a malformed module can abort jaxlib (SIGABRT) instead
of raising; if the child dies, the cases are split in halves and rerun, recursively, which names
the module that killed it and still runs every other case. A case whose module is missing is a
failure.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conformance_reference import decode, mismatch  # noqa: E402
from xla_check import compile_module  # noqa: E402


def load_cases(case_dir: Path) -> dict:
    """{family: [case, ...]} for every case file."""
    files = sorted(case_dir.glob("*.json"))
    if not files:
        raise SystemExit(f"no case files in {case_dir}")
    return {f.stem: json.loads(f.read_text())["cases"] for f in files}


def to_npz(a: np.ndarray) -> np.ndarray:
    """An output as .npz can hold it: .npz has no ml_dtypes types (a bf16 array would read back as
    raw void bytes), so those are stored as their bits, beside their type's name (`from_npz`)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" else a


def from_npz(a: np.ndarray, dtype_name: str) -> np.ndarray:
    """The inverse of `to_npz`."""
    return a.view(getattr(ml_dtypes, dtype_name)) if hasattr(ml_dtypes, dtype_name) else a


def run_cases(case_dir: Path, hlo_dir: Path, names: list, out: Path) -> None:
    """Child process: run the named cases, save outputs as .npz entries `CASE/K` (output K, with
    its numpy type's name in `CASE/K/dtype`) and errors as `CASE/error`."""
    cases = {c["name"]: c for cs in load_cases(case_dir).values() for c in cs}
    saved = {}
    for name in names:
        c = cases[name]
        try:
            run = compile_module((hlo_dir / f"{name}.hlo.pb").read_bytes())
            outs = run([decode(i["dtype"], i["shape"], i["data"]) for i in c["inputs"]])
            for k, o in enumerate(outs):
                saved[f"{name}/{k}"] = to_npz(o)
                saved[f"{name}/{k}/dtype"] = np.array(o.dtype.name)
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            saved[f"{name}/error"] = np.array(f"{type(e).__name__}: {e}")
    np.savez(out, **saved)


def run_in_children(names: list, case_dir: Path, hlo_dir: Path, tmp: Path) -> tuple[dict, dict]:
    """Runs the cases in one child process; if it dies, in two halves, recursively, so a module
    that aborts XLA is named and every other case still runs. Returns (outputs, aborts)."""
    out = tmp / f"run{len(list(tmp.iterdir()))}.npz"
    p = subprocess.run(
        [sys.executable, __file__, "--child", str(case_dir), str(hlo_dir), str(out), *names],
        capture_output=True,
        text=True,
    )
    if p.returncode == 0:
        got = np.load(out)
        return {k: got[k] for k in got.files}, {}
    if len(names) == 1:
        return {}, {names[0]: f"XLA aborted (exit {p.returncode}): {p.stderr.strip()[-1500:]}"}
    half = len(names) // 2
    a_out, a_err = run_in_children(names[:half], case_dir, hlo_dir, tmp)
    b_out, b_err = run_in_children(names[half:], case_dir, hlo_dir, tmp)
    return a_out | b_out, a_err | b_err


def check_all(families: dict, case_dir: Path, hlo_dir: Path) -> dict:
    """{case name: None (passed) or what went wrong} for every case."""
    results, present = {}, []
    for cases in families.values():
        for c in cases:
            if (hlo_dir / f"{c['name']}.hlo.pb").is_file():
                present.append(c["name"])
            else:
                results[c["name"]] = f"{c['name']}.hlo.pb is missing from {hlo_dir} (run the Rust conformance test with DEEPINFER_CONFORMANCE_OUT)"
    with tempfile.TemporaryDirectory() as tmp:
        outputs, aborts = run_in_children(present, case_dir, hlo_dir, Path(tmp))
    results |= aborts
    by_name = {c["name"]: c for cases in families.values() for c in cases}
    for name in present:
        if name in results:
            continue
        if f"{name}/error" in outputs:
            results[name] = f"XLA failed: {outputs[f'{name}/error']}"
            continue
        errors = []
        for k, o in enumerate(by_name[name]["outputs"]):
            got = outputs.get(f"{name}/{k}")
            if got is not None:
                got = from_npz(got, str(outputs[f"{name}/{k}/dtype"]))
            want = decode(o["dtype"], o["shape"], o["data"])
            e = f"`{o['name']}`: XLA returned no output {k}" if got is None else mismatch(got, want, o)
            if e:
                errors.append(e)
        results[name] = "; ".join(errors) or None
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_cases(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[5:], Path(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case_dir", type=Path, help="tests/conformance")
    ap.add_argument("hlo_dir", type=Path, help="where the Rust test wrote CASE.hlo.pb")
    ap.add_argument("--family", help="run one family only")
    args = ap.parse_args()
    families = load_cases(args.case_dir)
    if args.family:
        families = {args.family: families[args.family]}
    failures, known, table = [], [], []
    results = check_all(families, args.case_dir, args.hlo_dir)
    for family, cases in families.items():
        n_pass = n_known = n_fail = 0
        for c in cases:
            err, why = results[c["name"]], c["known_failures"].get("xla")
            if err is None and why is None:
                n_pass += 1
            elif err is not None and why is None:
                n_fail += 1
                failures.append(f"{c['name']} on xla: {err}")
            elif err is not None:
                n_known += 1
                known.append(f"{c['name']} on xla: {why}\n      got: {err}")
            else:
                n_fail += 1
                failures.append(f"{c['name']} on xla: passes, but is listed as a known failure ({why}); remove the entry from scripts/make_conformance.py and regenerate")
        table.append((family, len(cases), n_pass, n_known, n_fail))
        print(f"{family:<10} {len(cases):>4} cases: {n_pass} passed, {n_known} known failures, {n_fail} failed", flush=True)
    total = [sum(r[i] for r in table) for i in range(1, 5)]
    print(f"{'total':<10} {total[0]:>4} cases: {total[1]} passed, {total[2]} known failures, {total[3]} failed")
    if known:
        print(f"\nknown failures ({len(known)}):\n  " + "\n  ".join(known))
    for f in failures:
        print("FAIL", f)
    print(f"xla_conformance: {total[1]} passed, {total[2]} known failures, {total[3]} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
