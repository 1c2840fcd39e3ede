"""The plain-torch runtime of sequence pipelines: units and the KV context, its slabs and arenas, the
sequence cut, context parallelism inside units, packed documents, RoPE positions, the loss, and
torch's private names (:mod:`.torch_internals`). Imports neither torchtitan nor the rest of the package.
"""
