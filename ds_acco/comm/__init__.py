"""Communication: collectives as plain functions, and the lane that runs rounds beside compute."""
from .lane import CommLane, CommRoundError, CommTimeoutError, RoundHandle

__all__ = ["CommLane", "CommRoundError", "CommTimeoutError", "RoundHandle"]
