"""GitHub Actions workflows: YAML -> validated model -> `Plan`."""

from preloop.workflow.plan import Cohort, ConcurrencySpec, Plan, PlannedJob

__all__ = ["Cohort", "ConcurrencySpec", "Plan", "PlannedJob"]
