"""Processors built for images only: a family whose processor has a video processor (Family.image_only) gets its
processor class without it, since the video processor needs torchvision (not a requirement: images never use it).
The classes are made on demand from transformers' class of the same name (image_only, or ImageOnly<Name> as an
attribute of this module, which is how a pickled processor finds its class again)."""
import functools
import sys

import transformers


class ImageOnly:
    """A processor without its video processor, which needs torchvision (not a requirement: images never use it)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor" or argument is not None:
            super().check_argument_for_proper_class(argument_name, argument)


@functools.cache
def image_only(base):
    """The processor class `base` (a transformers class) images only: ImageOnly<base name>. A processor whose module
    reads num2words (SmolVLM's video prompts spell the frame count) is built without it: a stand-in that refuses to
    be called takes its place while the processor is built."""
    module, name = sys.modules[base.__module__], f"ImageOnly{base.__name__}"
    own = {"__module__": __name__, "__qualname__": name, "__doc__": f"{base.__name__}, images only."}
    if hasattr(module, "num2words"):
        own["__init__"] = without_num2words(base.__init__, module)
    return type(name, (ImageOnly, base), own)


def without_num2words(init, module):
    """`init` run with module.num2words a stand-in when the package is missing (its signature kept: transformers
    reads a processor's sub-processors off it)."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        held, module.num2words = module.num2words, module.num2words or no_num2words
        try:
            init(self, *args, **kwargs)
        finally:
            module.num2words = held
    return __init__


def no_num2words(*args, **kwargs):
    """What SmolVLM's video prompts would call: never reached with images only."""
    raise ImportError("SmolVLM's video prompts need num2words (pip install num2words); images do not")


def __getattr__(name):
    """ImageOnly<Name>: image_only of transformers' <Name> (a pickled processor's class, found again by name)."""
    if name.startswith("ImageOnly") and hasattr(transformers, name.removeprefix("ImageOnly")):
        return image_only(getattr(transformers, name.removeprefix("ImageOnly")))
    raise AttributeError(f"module {__name__} has no attribute {name}")
