"""Zoo Gym: federated community delta learning.

Parts, in layers (docs/design/ARCHITECTURE.md): proto (wire contract), io (big-file reads and writes),
codec (delta <-> bytes), aggregation (DeltaSoup), evaluation (held-out loss and gradients), gym_train
(local training), rewards (scores, reputation, ledger), serving (gym-serve), server, dashboard, client,
integrations (Flower).
"""

__version__ = "0.2.0"

import logging as _logging

# bitsandbytes (extra `qlora`), imported by transformers whenever it is installed, warns on every start on
# AVX512-BF16 CPUs that it could not fetch an optional kernel from the Hugging Face Hub ("Failed to load
# CPU gemm_4bit_forward from kernels-community"). Zoo Gym never downloads code at run time and its QLoRA
# check (gym_train/qlora.py) says plainly whether 4-bit training works, so that line is only noise.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
