"""The former name of `annotated.attention_maps` (attention dumps, pictures, the viewer); imports of the old name keep working."""
from annotated.attention_maps import *  # noqa: F401,F403
from annotated.attention_maps import dump, log_alignment_image  # noqa: F401
