import sys

from covrl.cli import main

sys.exit(main())
