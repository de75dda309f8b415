"""Big-file I/O the server and the evaluation share: tensor-by-tensor safetensors reads (also inside a
checkpoint archive), writes around the page cache (O_DIRECT), page-cache hints and read-ahead on a thread.

Imports nothing of zoo_gym but `proto.archive` (where a checkpoint archive keeps its weights).
"""
