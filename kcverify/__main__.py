import sys

from kcverify.cli import main

sys.exit(main())
