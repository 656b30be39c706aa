"""`python -m justitia_cli`: the `justitia` command without the console script.

`main` and `CommandError` live in the package, not in this `__main__` module, so the command
modules and `main` share one `CommandError` class (a one-line error, not a traceback).
"""

import sys

from justitia_cli import main

sys.exit(main())
