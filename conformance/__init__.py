"""glmport.conformance: the shared suite that decides whether a backend is right.

Cases as data (the ``cases`` package, one module per op family; ``badinput``), judges
against the float64 reference (``judges``), the runner (``runner``; calling an op of a
case and the reference in ``calls``, the gradient checks in ``gradients``, expert
parallelism in ``ep_case``, the tiny model in ``model_case``), reports (``report``; the
HTML page in ``html``; their shared cell and line text in ``formatting``) and the
pytest module (``suite``), driven by the ``pytest_glmport`` plug-in and ``glmport
conformance``. The portability tools judge with the same judges: ``diff`` (``glmport
diff``: where two backends part ways on a model; one op call on its own and its replay
file in ``replay``) and ``matrix`` (``glmport conformance --matrix``: every backend
pair's model-level mismatch). The suite's own power:
``mutants`` (a library of porting bugs), ``mutation`` (one mutant judged),
``mutation_suite`` and ``mutation_report`` (``glmport conformance --mutants``: the
kill rate).
"""
