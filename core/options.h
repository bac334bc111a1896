// KILN_OPTION: one line per field of a chainable options class, the one options idiom of kiln
// (layers, losses, optimizers, data): `SGDOptions(0.1).momentum(0.9)`, `LinearOptions(4, 2).bias(false)`.
//
//   struct LinearOptions {
//     LinearOptions(int64_t in, int64_t out) : in_features_(in), out_features_(out) {}
//     KILN_OPTION(bool, bias, true)   // options.bias(false) sets it; options.bias() reads it
//   };
#pragma once

#define KILN_OPTION(Type, name, default_value) \
 public:                                       \
  auto& name(Type value) {                     \
    name##_ = value;                           \
    return *this;                              \
  }                                            \
  Type name() const { return name##_; }        \
                                               \
 private:                                      \
  Type name##_ = default_value;                \
                                               \
 public:
