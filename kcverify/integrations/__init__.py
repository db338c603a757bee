"""Integrations with the systems around a model (optional extras): ``kcverify.integrations.mlflow``
is the MLflow Model Registry gate (``pip install 'kcverify[mlflow]'``)."""
