import sys

from pled.cli import main

sys.exit(main())
