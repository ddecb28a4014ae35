import sys

from snugfit.cli import main

sys.exit(main())
