"""glmport.export: ONNX and TVM export of the ops and the model. Not built yet."""
