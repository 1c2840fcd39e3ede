"""torchtitan_seq's integration with torchtitan 0.3 (torch 2.14 or later).

A thin layer over the plain-torch core (:mod:`torchtitan_seq.schedules`) and what both versions share
(:mod:`torchtitan_seq.titan`), beside 0.2.2's (:mod:`torchtitan_seq.titan.v022`):

* :mod:`.registration` — the one registration point: the shipped datasets in torchtitan's table;
* :mod:`.model` — 0.3's decoder families (Llama 3, Qwen3, DeepSeek-V3, gpt-oss) with chunk-aware inner attention;
* :mod:`.pipeline` — its ``pipelining_fn``: sequence schedules by name, torch's through 0.3's own;
* :mod:`.trainer` — ``SeqTrainer`` and its config, 0.3's with the ``sequence_pipeline`` section;
* :mod:`.metrics` — its metrics processor: 0.2.2's per-rank metrics, timeline and ``metrics.jsonl``;
* :mod:`.job_check` — the check every rank and ``--check`` run first;
* the config functions are :mod:`torchtitan_seq.recipes` (``--module torchtitan_seq.recipes``).

Importing it changes nothing; :mod:`torchtitan_seq.train` applies the CPU compatibility and registers.
"""
