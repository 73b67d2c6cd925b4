"""Generation without a server, in the caller's process over the engine: batch (`make generate`: a table, local
workers or Ray Data actors) and pyfunc (the MLflow `python_function` model: mlflow.pyfunc.load_model, spark_udf)."""
