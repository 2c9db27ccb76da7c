import sys

from megamoe.apps.cli import main

sys.exit(main())
