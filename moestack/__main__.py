import sys

from moestack.cli.app import main

sys.exit(main())
