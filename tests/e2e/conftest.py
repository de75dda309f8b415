"""End-to-end tests share e2e_processes.py (how they start real gym-server and gym-client processes);
pytest runs with --import-mode=importlib, so this folder is put on the path for that import."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
