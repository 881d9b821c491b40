// Precompiled header: the LibTorch headers most translation units need. Kept small on purpose.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/autograd.h>
