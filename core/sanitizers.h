// Which sanitizers instrument this build, as 0/1 macros: GCC says so with __SANITIZE_*__, clang
// (the fuzzers' compiler) with __has_feature. One test for every header that behaves differently
// under them.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_HWADDRESS__)
#define KILN_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(hwaddress_sanitizer)
#define KILN_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef KILN_ADDRESS_SANITIZER
#define KILN_ADDRESS_SANITIZER 0
#endif

#if defined(__SANITIZE_THREAD__)
#define KILN_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KILN_THREAD_SANITIZER 1
#endif
#endif
#ifndef KILN_THREAD_SANITIZER
#define KILN_THREAD_SANITIZER 0
#endif

// MemorySanitizer is clang's alone.
#if defined(__has_feature)
#if __has_feature(memory_sanitizer)
#define KILN_MEMORY_SANITIZER 1
#endif
#endif
#ifndef KILN_MEMORY_SANITIZER
#define KILN_MEMORY_SANITIZER 0
#endif
