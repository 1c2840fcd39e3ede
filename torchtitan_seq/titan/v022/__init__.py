"""torchtitan_seq's integration with torchtitan 0.2.2: the train spec (``llama3_seq``), its pipelining
function, trainer, metrics and job check, and the one registration point (:mod:`.registration`).

Importing it changes nothing; :mod:`torchtitan_seq.train` applies the CPU compatibility and registers.
"""
