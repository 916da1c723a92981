"""Request predictors: features, quality and output-length regressors, success classifier.

What routing asks per request and candidate model: the answer's quality (LightGBM over
hashed-token PCA, counts and task, as in the SFS paper), its output length (LightGBM heads for
mean, median and p90 in log space) and the probability it is correct (a logistic regression
per model over language, task and length bucket, as in LAAR). See docs/predict.md.

Hot path::

    p = Predictor.load("model-dir")
    f = p.features(prompt_text, task=None)             # one scan of the text
    out = p.predict(f, ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])   # all heads, all models

Policies take a :class:`QualitySource`: :class:`TaskTable`, :class:`Oracle` or
:class:`Trained`. Training and evaluation (``training``, ``evaluation``) import LightGBM and
scikit-learn when called; loading and predicting do not.
"""

from duetime.predict.buckets import bucket_label, length_bucket
from duetime.predict.data import DataError, Row, iter_rows, parse_row, read_rows
from duetime.predict.evaluation import evaluate
from duetime.predict.features import RequestFeatures, TextFeatures, text_features
from duetime.predict.language import LANGUAGES, detect_language
from duetime.predict.persistence import PredictorFormatError
from duetime.predict.predictor import (
    Predictions,
    Predictor,
    UnknownModelError,
    load_predictor,
)
from duetime.predict.quality_source import (
    Oracle,
    QualitySource,
    Query,
    QueryTable,
    TaskTable,
    Trained,
)
from duetime.predict.remaining import remaining_tokens
from duetime.predict.tokens import FAST, FastEstimate, HFTokenizer, Tokenizer
from duetime.predict.training import TrainingError, TrainOptions, train

__all__ = [
    "FAST",
    "LANGUAGES",
    "DataError",
    "FastEstimate",
    "HFTokenizer",
    "Oracle",
    "Predictions",
    "Predictor",
    "PredictorFormatError",
    "QualitySource",
    "Query",
    "QueryTable",
    "RequestFeatures",
    "Row",
    "TaskTable",
    "TextFeatures",
    "Tokenizer",
    "TrainOptions",
    "Trained",
    "TrainingError",
    "UnknownModelError",
    "bucket_label",
    "detect_language",
    "evaluate",
    "iter_rows",
    "length_bucket",
    "load_predictor",
    "parse_row",
    "read_rows",
    "remaining_tokens",
    "text_features",
    "train",
]
