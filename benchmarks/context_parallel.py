"""Activation memory of context parallelism inside units (#29): pp 2 x cp 2 against pp 2, measured and
as the memory model predicts it.

    python benchmarks/context_parallel.py --seq-lens 4096,8192 --out benchmarks/context_parallel

Every run trains the Llama 3 debug model (``train_configs/debug_model.toml``: Seq1F1B, k = 4, the
'compute' cut, N = 4 microbatches of one sequence) for ``--steps`` steps through ``./run_train.sh`` on
CPU ranks, every step metered (``activation_memory_freq = 1``), with float32 parameters in both meshes
(under CP torchtitan's FSDP spans the CP ranks and would cast them to bf16). What is compared, per
pipeline rank: the peak of saved activations (:class:`torchtitan_seq.instrumentation.memory.ActivationMemory`, the
trainer's ``peak_activation_bytes``; under CP the larger of the rank's two CP ranks) over the steps,
and :func:`~torchtitan_seq.simulate.memory.predict_memory`'s ``activations`` for the same job. The
meshes alternate run by run; the load average is recorded at each run's start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout's package

from torchtitan_seq.runtime.shape import JobShape  # noqa: E402
from torchtitan_seq.simulate.memory import MemoryConfig, predict_memory  # noqa: E402
from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors  # noqa: E402
from training_run import run_train  # noqa: E402  (benchmarks/, this script's folder)

K, MICROBATCHES, PP, LENGTH_MULTIPLE = 4, 4, 2, 64  # the config's
MESHES = {"pp2": 1, "pp2 x cp2": 2}  # name: CP degree


def predicted(seq_len: int, cp: int) -> list[int]:
    """The memory model's activation peak per pipeline rank (bytes)."""
    shape = JobShape.of_model(
        seq_llama3_flavors["debugmodel"],
        seq_len,
        K,
        "compute",
        length_multiple=LENGTH_MULTIPLE,
        cp=cp,
        microbatches=MICROBATCHES,
    )
    config = MemoryConfig("debugmodel", shape, "Seq1F1B", pp=PP, device="cpu", mixed_precision_param="float32")
    return [r.activations for r in predict_memory(config).ranks]


def measure(seq_len: int, cp: int, steps: int, out: Path) -> dict:
    """One run: per global rank, its largest peak over the metered steps."""
    load = os.getloadavg()[0]
    run = run_train(
        "--training.seq_len",
        str(seq_len),
        "--training.steps",
        str(steps),
        "--parallelism.context_parallel_degree",
        str(cp),
        "--training.mixed_precision_param",
        "float32",
        "--sequence_pipeline.activation_memory_freq",
        "1",
        dump_folder=out / f"s{seq_len}_cp{cp}",
        env={"NGPU": str(PP * cp)},
        timeout=3600,
    )
    if run.returncode:
        raise RuntimeError(f"seq {seq_len}, cp {cp} failed:\n{run.output[-3000:]}")
    peaks = [max(step[r] for step in run.activation_bytes if step) for r in range(PP * cp)]
    return {"seq_len": seq_len, "cp": cp, "lengths": run.lengths, "load_average": load, "peak_activation_bytes": peaks}


def table(records: list[dict]) -> list[str]:
    """Markdown rows: per length and pipeline rank, measured and predicted MiB under both meshes."""
    mib = 2**20
    rows = [
        "| seq | pipeline rank | pp2 measured | predicted | pp2 x cp2 measured (both CP ranks) | predicted "
        "| cp2 / pp2 measured | predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seq_len in sorted({r["seq_len"] for r in records}):
        by_cp = {r["cp"]: r for r in records if r["seq_len"] == seq_len}
        for rank in range(PP):
            alone, split = by_cp[1], by_cp[2]
            a = alone["peak_activation_bytes"][rank]
            both = split["peak_activation_bytes"][rank * 2 : rank * 2 + 2]
            pa, pc = alone["predicted"][rank], split["predicted"][rank]
            rows.append(
                f"| {seq_len} | {rank} | {a / mib:.1f} | {pa / mib:.1f} | {both[0] / mib:.1f}, {both[1] / mib:.1f} "
                f"| {pc / mib:.1f} | {max(both) / a:.3f} | {pc / pa:.3f} |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="4096,8192", help="comma-separated lengths")
    ap.add_argument("--steps", type=int, default=2, help="training steps per run (all metered)")
    ap.add_argument("--out", type=Path, default=Path("context_parallel_out"), help="output folder")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for cp in MESHES.values():
            record = measure(seq_len, cp, args.steps, args.out / "runs")
            record["predicted"] = predicted(seq_len, cp)
            records.append(record)
            print(json.dumps(record), flush=True)
    (args.out / "context_parallel.json").write_text(json.dumps(records, indent=1) + "\n")
    (args.out / "context_parallel.md").write_text("\n".join(table(records)) + "\n")
    print("\n".join(table(records)))


if __name__ == "__main__":
    main()
