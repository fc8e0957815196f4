"""The planner: enumerate plans (space.py), keep those that fit and rank them by speed (search.py)."""
from memkit.planner.search import Candidate, NoPlanFits, Rejection, SearchResult, search
from memkit.planner.space import DEFAULT_HEADROOM, Request

__all__ = ["Candidate", "DEFAULT_HEADROOM", "NoPlanFits", "Rejection", "Request", "SearchResult", "search"]
