"""The application on top of the library: command line, main job, offline search, task suite and
evaluation, prompts, model loading and plots.

Nothing in the library (``minference.patterns``, ``config``, ``index``, ``dispatch``,
``integration``, ``distributed``, ``torch_backend``, ``testing``, ``kernels``, ``reference``)
imports from here.
"""
