"""``python -m glmport``: the same CLI as the ``glmport`` command."""

import sys

from glmport.cli import main

sys.exit(main())
