"""Pipeline planner: rank every schedule x micro-batch count x virtual stages x recompute x layer
split by simulated throughput, per-stage memory and weight-version drift (torch-free).

Why a package of small modules: each input the ranking depends on (unit costs, their datasheet
source, the layer split, the memory model, the candidates' grid) is checked on its own against
hand-computed cases, and ``tools/plan_pipeline.py`` and ``--pipeline-schedule auto`` share them.
"""
