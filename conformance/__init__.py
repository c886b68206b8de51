"""glmport.conformance: the shared suite that decides whether a backend is right.

Cases as data (``cases``, ``badinput``), judges against the float64 reference
(``judges``), the runner (``runner``; expert parallelism in ``ep_case``, the tiny
model in ``model_case``), reports (``report``) and the pytest module (``suite``),
driven by the ``pytest_glmport`` plug-in and ``glmport conformance``.
"""
