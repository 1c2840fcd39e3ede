"""The benchmark leaves out, with the job check's one line, what cannot run here, and measures the rest."""

import bench


def test_a_schedule_the_job_check_refuses_is_left_out_not_fatal():
    args = bench._parser().parse_args(["--schedules", "1F1B,DualPipeV,Seq1F1B", "--seq-lens", "256,250"])
    variants = bench.parse_variants(args.schedules, args.subsequences, args.partition)
    refused = bench.refusals(variants, args)
    assert {(v.schedule, n) for v, n in refused} == {("DualPipeV", 256), ("DualPipeV", 250), ("Seq1F1B", 250)}
    assert all("\n" not in message for message in refused.values())
    assert "pipeline_parallel_expert_parallel_overlap = false" in refused[variants[1], 256]
