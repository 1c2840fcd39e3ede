"""The integration with torchtitan: what both versions share (the job rules, building a sequence pipeline,
the model flavors' shapes, the datasets, the CPU compatibility, the version in use), and a thin layer
per version: :mod:`.v022` (torchtitan 0.2.2: TOML configs, the train spec) and :mod:`.v03` (0.3: config
functions and recipes).
"""
