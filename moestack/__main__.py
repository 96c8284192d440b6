import sys

from moestack.cli import main

sys.exit(main())
