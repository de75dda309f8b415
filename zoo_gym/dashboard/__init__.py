"""The federation's read-only web dashboard (`gym-server serve --dashboard-port P`): pages, JSON API, /metrics."""

from zoo_gym.dashboard.app import create_app
from zoo_gym.dashboard.serve import DashboardServer

__all__ = ["DashboardServer", "create_app"]
