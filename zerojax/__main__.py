import sys

from zerojax.app.cli import main

sys.exit(main())
