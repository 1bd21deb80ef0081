"""
Pickles read without running them: a pickle runs code only through a global it names (os.system,
builtins.exec, subprocess.Popen, called by REDUCE), so each reader admits the globals its file
holds and refuses the rest in one line (nanoGPT's meta.pkl: none, dataio/tokenizer.py; nanochat's
tokenizer.pkl and token_bytes.pt: dataio/chat_tokenizer.py).
"""

import pickle


class RefusedGlobal(pickle.UnpicklingError):
    """What NoGlobals raises: the file names code, where another broken pickle is only broken."""


class NoGlobals(pickle.Unpickler):
    """An unpickler that resolves no global. A pickle runs code only through a global it names
    (os.system, builtins.exec, subprocess.Popen, called by REDUCE), and nanoGPT's meta.pkl, a dict
    of ints and strings, names none."""

    def find_class(self, module, name):
        raise RefusedGlobal(f"it names the callable {module}.{name}, which is never run")


def short(value, limit=40):
    """A value for an error line: its repr when short and plain, else its type."""
    text = repr(value) if isinstance(value, (str, int, float)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."
