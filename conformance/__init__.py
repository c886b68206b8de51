"""glmport.conformance: the shared suite that decides whether a backend is right.
Not built yet; ``glmport.core.tolerance`` already holds the tolerances it will use."""
