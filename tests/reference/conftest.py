import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from triton_import import import_triton_interpreted  # noqa: E402

import_triton_interpreted()  # before the modules here import transformers' models (see triton_import)
