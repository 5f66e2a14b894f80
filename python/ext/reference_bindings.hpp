// Python access to the host reference, for the GPU tests' comparisons.
#pragma once

#include <nanobind/nanobind.h>

namespace turnout::bindings {

void bind_reference(nanobind::module_& m);

}  // namespace turnout::bindings
