import sys

from seqpar.bench import main

sys.exit(main())
