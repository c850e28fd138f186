"""Spark and its JVM: the SparkSession, the driver JVM's launch, the warm Python worker daemon."""
