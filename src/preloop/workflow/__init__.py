"""GitHub Actions workflows: YAML -> validated model -> `Plan`.

- `load_workflow(path) -> Workflow` (raises `WorkflowError` listing every
  problem as `path:line:col: message`);
- `plan(workflow, event, ...) -> Plan` and `expand_deferred(job, contexts)`;
- `expand_matrix(matrix)`; expressions in `preloop.workflow.expressions`.
"""

from preloop.workflow.loader import WorkflowError, load_workflow, workflow_files
from preloop.workflow.matrix import MAX_MATRIX_LEGS, MatrixError, expand_matrix
from preloop.workflow.model import Job, Matrix, Step, Strategy, Workflow
from preloop.workflow.plan import Cohort, ConcurrencySpec, Plan, PlannedJob
from preloop.workflow.planner import DeferredExpansion, PlanError, expand_deferred, plan

__all__ = [
    "MAX_MATRIX_LEGS",
    "Cohort",
    "ConcurrencySpec",
    "DeferredExpansion",
    "Job",
    "Matrix",
    "MatrixError",
    "Plan",
    "PlanError",
    "PlannedJob",
    "Step",
    "Strategy",
    "Workflow",
    "WorkflowError",
    "expand_deferred",
    "expand_matrix",
    "load_workflow",
    "plan",
    "workflow_files",
]
