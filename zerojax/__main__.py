import sys

from zerojax.cli import main

sys.exit(main())
