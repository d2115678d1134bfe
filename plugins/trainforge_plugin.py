"""Checkout-only shim: the plugin lives in the installed package (:mod:`trainforge.plugin`) and
Airflow loads it through the ``airflow.plugins`` entry point. This file keeps an Airflow whose
plugins folder is this checkout's ``plugins/`` working; the plugins manager registers a plugin
name once, whichever way it was found first.
"""

from trainforge.plugin import TrainforgePlugin

__all__ = ["TrainforgePlugin"]
