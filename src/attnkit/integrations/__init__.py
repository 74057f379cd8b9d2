"""attnkit inside other libraries' models.

``attnkit.integrations.transformers``: attnkit as an attention implementation for Hugging Face
transformers (``register()``, then ``attn_implementation="attnkit"``), and the attention maps
of any such model for ``attnkit.viz``. transformers is an optional dependency, imported only
when a function here needs it (``pip install 'attnkit[hf]'``); importing this package imports
nothing from it.
"""
