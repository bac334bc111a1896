// kiln::optim: optimizers (SGD, Adam, AdamW), learning-rate schedules, gradient clipping and
// loss scaling for mixed precision (GradScaler).
//
//   kiln::optim::Adam opt(params, kiln::optim::AdamOptions(1e-3));
//   kiln::optim::CosineAnnealingLR schedule(opt, /*T_max=*/1000);
//   for (...) { opt.step(loss_of(batch)); schedule.step(); }
#pragma once
#include "optim/adam.h"
#include "optim/clip.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"
#include "optim/lr_schedule.h"
#include "optim/serialize.h"
#include "optim/sgd.h"
#include "optim/train_step.h"
