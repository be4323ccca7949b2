"""Triton Python backend preprocessor of the two-container stack (before visiongate):
OpenCV decode, resize to 224x224, scale to [0, 1], normalise as EfficientNet-Lite wants
((pixel - 127) / 128), HWC -> CHW."""

import cv2
import numpy as np

SIZE = (224, 224)  # (width, height) for cv2.resize
MEAN = np.array([0.498, 0.498, 0.498], dtype=np.float32)  # 127 / 255
STD = np.array([0.502, 0.502, 0.502], dtype=np.float32)  # 128 / 255


def preprocess(row: np.ndarray) -> np.ndarray:
    """One zero-padded row of encoded image bytes -> FP32 [3, 224, 224]."""
    image = cv2.imdecode(row, cv2.IMREAD_COLOR)  # BGR; trailing padding is ignored
    image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    image = cv2.resize(image, SIZE, interpolation=cv2.INTER_AREA)
    x = (image.astype(np.float32) / 255.0 - MEAN) / STD
    return x.transpose(2, 0, 1)


class TritonPythonModel:
    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "IMAGE_BYTES").as_numpy()
            out = np.stack([preprocess(r) for r in rows])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", out)]))
        return responses
