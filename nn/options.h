// KILN_NN_OPTION: one line per field of a chainable options class, as in
//
//   class LinearOptions {
//    public:
//     LinearOptions(int64_t in, int64_t out) : in_features_(in), out_features_(out) {}
//     KILN_NN_OPTION(bool, bias, true);   // LinearOptions(4, 2).bias(false); options.bias()
//   };
#pragma once

// Declares a chainable option: `Options& name(type v)` sets it and `type name() const` reads it.
#define KILN_NN_OPTION(type, name, default_value)         \
 public:                                                  \
  auto& name(type value) {                                \
    name##_ = value;                                      \
    return *this;                                         \
  }                                                       \
  type name() const { return name##_; }                   \
                                                          \
 private:                                                 \
  type name##_ = default_value
