"""Instrumentation: activation memory (:mod:`.memory`), per-pass timing of a step (:mod:`.timeline`) and the
timeline's rendering (:mod:`.render`), shared by the runtime, the integrations and the simulator; the
trainer's structured record read back (:mod:`.record`).
"""
